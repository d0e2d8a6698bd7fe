"""`meshrun bench`: the mesh measured through the same path training takes."""
