"""Study configs: one ml_collections file per study (see common.py)."""
