"""eyas training: the Hydra-configured trainer, its evaluation, export and command line."""

# importing eyas.data keeps a source checkout after the installed packages on sys.path before
# anything here imports transformers (eyas.data.checkout says why)
import eyas.data  # noqa: E402,F401
