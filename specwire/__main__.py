from specwire.client.cli import main

raise SystemExit(main())
