"""Built-in models shipped inside the package (each a diffusers pipeline folder)."""
