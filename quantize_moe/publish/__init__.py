"""Publishing: the run record, the model card and the upload to the Hub."""
