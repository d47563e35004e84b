"""hetflow.ml: Arrow to PyTorch, distributed training and inference."""
