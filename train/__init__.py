"""eyas training: the Hydra-configured trainer, its evaluation, export and command line."""

from eyas.data.checkout import keep_checkout_last

keep_checkout_last()    # before anything imports transformers (eyas.data.checkout says why)
