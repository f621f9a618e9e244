"""eyas models: the EAGLE-3 drafter, its TTT unroll, metrics and the serving contract."""

from eyas.data.checkout import keep_checkout_last

keep_checkout_last()    # before anything imports transformers (eyas.data.checkout says why)
