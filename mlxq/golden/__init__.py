"""Oracle goldens: mlx-lm's own generation on the same weights, written to goldens/."""
