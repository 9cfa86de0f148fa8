"""Text before the model: normalization (written forms to words) and sentence segmentation."""
