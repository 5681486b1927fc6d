"""What autogaudi sees of the training loop: steps, model calls, evaluation passes, placement."""
