"""Reading the store for people: the text/JSON report and the plots."""
