"""The public options: policy values, their validators and the deprecated spellings."""
