"""The common base of eyas: logging and exit statuses, locks and atomic writes, targets (presets,
loading, the hub), the settings the CLI shares with the trainer, provenance and checksums, and
the capture hooks every path that runs a target uses. Imports nothing else of eyas."""
