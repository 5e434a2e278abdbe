from remat.cli import main

raise SystemExit(main())
