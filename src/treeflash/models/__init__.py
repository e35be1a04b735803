"""Model definitions in plain torch; attention goes through `treeflash.kernels`."""
