"""Data: datasets as host arrays, torch's DistributedSampler, and a prefetching loader."""
