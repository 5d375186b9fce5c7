"""Per-op cost measurement of the torch engine and vLLM, written as tlt-profile CSV."""
