"""Input and output formats: one reader per format, the SQP1 record codec, the manifest."""
