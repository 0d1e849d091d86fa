"""Tensor parallelism: which rank this process is and the collectives between ranks (see parallel_state)."""
