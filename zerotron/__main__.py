from zerotron.cli import main

raise SystemExit(main())
