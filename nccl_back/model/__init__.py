"""The model and its bytes: identity, checkpoint files, storage, skeletons, the storage loader, integrity."""
