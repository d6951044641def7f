"""What a run tells the user: console or file-only log records, progress lines, TensorBoard scalars and tables."""
