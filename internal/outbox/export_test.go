package outbox

// WrapXIDExpr is wrapXIDExpr, for TestWidenXID.
const WrapXIDExpr = wrapXIDExpr
