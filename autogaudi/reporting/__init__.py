"""The report: rows, text, the JSON file and the HTML page."""
