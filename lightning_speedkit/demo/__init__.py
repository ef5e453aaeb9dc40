"""The embedded demo workload: generated shape images on disk, a DataModule and a small ResNet."""

__all__: list[str] = []
