"""The stages that build datasets: prompts and answers (prepare, generate, served, synthesize),
tokens, hidden states (extract with transformers, engine_capture with vLLM), importers,
verify, estimate and the draft vocabulary. They may import the common base, the format and the
runtime engine; models/ never imports them (the trainer's pipeline and the CLI do)."""
