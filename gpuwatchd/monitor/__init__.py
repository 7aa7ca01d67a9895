"""The live model of every GPU: the poller feeds a board of latest samples and gate decisions."""
