"""Public ops: each module validates, allocates and dispatches one op."""
