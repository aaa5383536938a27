"""Where weights come from: the model catalog, Medusa head modules and their files, loaders."""
