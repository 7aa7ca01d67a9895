"""Reading the store for people: ``text`` (the report table and JSON document),
``results_plot`` (``report --plot``) and ``timeline_plot`` (``plot-timeline``), both
drawn through ``figure``."""
