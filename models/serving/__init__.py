"""The serving contract: what vLLM and SGLang load, and the tools that write and check it.

`contract` holds the shared words (findings, the layout-A tensors and shapes, the tensor-directory
reader) and imports nothing else of this package; `export` / `export_speculators` / `importer`
write and read drafter directories; `validate_static` (with `validate_vocab`, the d2t/t2d
rules) and `validate_numeric` are the rules that `validate` runs; `loaders` loads an export with
the engines' own loaders; `reference` is the engine math re-derived independently of the
training forward; `doctor` explains low acceptance. The package builds on the network
(`eyas.models`); the network never imports it.
"""
