"""Model families: see engine/families/README.md."""
