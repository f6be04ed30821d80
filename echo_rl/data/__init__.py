"""Data Plane: the record schema, adapters, what turns records into learner tensors, and the
bounded-staleness replay buffer with its write-ahead log."""
