"""A classifier module that fails as it is imported (for test_model_aware)."""

raise RuntimeError("this module cannot be imported")
