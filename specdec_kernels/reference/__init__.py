"""Plain PyTorch implementations: the definition of correct for every op."""
