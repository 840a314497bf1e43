"""What two or more stages share: model adapters, corpora, artifact I/O, hardware specs and units."""
