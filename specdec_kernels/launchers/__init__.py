"""Host-side launchers of the Triton kernels (grid, workspace, one launch per call)."""
