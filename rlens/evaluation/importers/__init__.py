"""Importers that turn other tools' outputs into recorded-outputs datasets."""
