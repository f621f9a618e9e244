"""The dataset format and its readers: shard files and the manifest (FORMAT.md), the dataset,
the packed loader the trainer reads, the draft vocabulary map and `eyas inspect`. Imports only
the common base (eyas.data.common)."""
