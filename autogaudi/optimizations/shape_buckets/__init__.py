"""Shape buckets: variable sequence lengths padded up to a few lengths where the padding is provably masked."""
