"""Model families as pure functions over params pytrees."""
