"""eyas training: the Hydra-configured trainer, its evaluation, export and command line."""
