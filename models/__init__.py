"""eyas models: the EAGLE-3 drafter, its TTT unroll, metrics and the serving contract."""
