"""Tools: the command line and what it runs (doctor, demo, bench); nothing in the library imports them."""
