"""Running Persimmon as a cluster: job checkpoints and local process supervision."""
