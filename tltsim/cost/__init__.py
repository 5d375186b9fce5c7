"""Step-time models: roofline, measured profile tables, hardware/model/cluster presets."""
