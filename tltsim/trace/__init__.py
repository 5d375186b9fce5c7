"""The tlt-trace format: schema, load/validate/save (JSON, CSV, Parquet), importers, synthetic generator."""
