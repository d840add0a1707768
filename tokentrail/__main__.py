from tokentrail.cli import app

app()
