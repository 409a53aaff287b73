from keel.cli import entry

entry()
