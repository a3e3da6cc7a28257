"""Chapter 07: how ranks of a split model find each other and exchange tensors."""
