"""Run records: report.json and its fingerprints, provenance, evaluation records, non-stock extras, the model card."""
