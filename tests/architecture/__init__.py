"""The package's layers as import edges."""
