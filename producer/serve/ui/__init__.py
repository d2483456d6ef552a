"""The gateway's ``/ui`` page: plain HTML, CSS and JavaScript shipped in the package (no CDN)."""
