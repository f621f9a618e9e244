"""eyas models: the EAGLE-3 drafter, its TTT unroll, metrics and the serving contract."""

# importing eyas.data keeps a source checkout after the installed packages on sys.path before
# anything here imports transformers (eyas.data.checkout says why)
import eyas.data  # noqa: E402,F401
