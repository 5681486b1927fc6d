"""The cache folder and what is remembered in it between runs."""
