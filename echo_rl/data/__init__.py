"""Data Plane: the record schema, adapters and what turns records into learner tensors."""
